// ddprun-agent: the per-node agent as a daemon entry of its own (same command line as ddprun).
#include "main_common.h"

int main(int argc, char** argv) {
  return ddprun::launcher::launcherMain("ddprun-agent", argc, argv);
}
