#include "main_common.h"

int main(int argc, char** argv) { return ddprun::launcher::launcherMain("ddprun", argc, argv); }
