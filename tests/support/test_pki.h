// A throwaway PKI for the TLS tests: a CA and a server certificate made with openssl.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include "ddprun/common/strings.h"
#include "process_helpers.h"

namespace ddprun::testing {

// A throwaway CA and a server certificate signed by it for the given IP addresses (its
// subjectAltName; 127.0.0.1 unless told), made with the openssl command line in `dir`. ok is
// false, with the reason in `why`, where openssl is missing or fails.
struct TestPki {
  explicit TestPki(const TempDir& dir, const std::vector<std::string>& ips = {"127.0.0.1"})
      : ca(dir / "ca.pem"), cert(dir / "server.pem"), key(dir / "server.key") {
    std::string san;
    for (const auto& ip : ips) san += (san.empty() ? "IP:" : ",IP:") + ip;
    std::ofstream(dir / "ca.cnf") << "[req]\n"
                                     "distinguished_name = dn\n"
                                     "prompt = no\n"
                                     "x509_extensions = v3_ca\n"
                                     "[dn]\n"
                                     "CN = ddprun test CA\n"
                                     "[v3_ca]\n"
                                     "basicConstraints = critical, CA:TRUE\n"
                                     "keyUsage = critical, keyCertSign, cRLSign\n"
                                     "subjectKeyIdentifier = hash\n";
    std::ofstream(dir / "server.cnf") << "[req]\n"
                                         "distinguished_name = dn\n"
                                         "prompt = no\n"
                                         "[dn]\n"
                                         "CN = " +
                                             ips.at(0) +
                                             "\n"
                                             "[ext]\n"
                                             "basicConstraints = CA:FALSE\n"
                                             "keyUsage = critical, digitalSignature\n"
                                             "extendedKeyUsage = serverAuth\n"
                                             "subjectAltName = " +
                                             san + "\n";
    const std::vector<std::string> ec = {"-newkey", "ec", "-pkeyopt",
                                         "ec_paramgen_curve:prime256v1", "-nodes"};
    std::vector<std::string> make_ca = {"openssl",      "req",   "-x509", "-config",
                                        dir / "ca.cnf", "-days", "2",     "-keyout",
                                        dir / "ca.key", "-out",  ca};
    make_ca.insert(make_ca.end(), ec.begin(), ec.end());
    std::vector<std::string> make_csr = {"openssl",          "req",     "-new", "-config",
                                         dir / "server.cnf", "-keyout", key,    "-out",
                                         dir / "server.csr"};
    make_csr.insert(make_csr.end(), ec.begin(), ec.end());
    const std::vector<std::string> sign = {"openssl",
                                           "x509",
                                           "-req",
                                           "-in",
                                           dir / "server.csr",
                                           "-CA",
                                           ca,
                                           "-CAkey",
                                           dir / "ca.key",
                                           "-CAcreateserial",
                                           "-days",
                                           "2",
                                           "-out",
                                           cert,
                                           "-extfile",
                                           dir / "server.cnf",
                                           "-extensions",
                                           "ext"};
    for (const auto& argv : {make_ca, make_csr, sign}) {
      Finished f = run(argv);
      if (f.exit_code == 127) {
        why = "openssl is not installed (deploy/install-deps.sh installs it)";
        return;
      }
      if (f.exit_code != 0) {
        why = join(argv, " ") + " failed: " + f.err;
        return;
      }
    }
    ok = true;
  }
  bool ok = false;
  std::string why;
  std::string ca, cert, key;
};

}  // namespace ddprun::testing
