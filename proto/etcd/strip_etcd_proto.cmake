# Copies one of etcd's v3 API .proto files (as Debian's golang-etcd-server-dev installs them) with
# what only Go needs removed: the gogoproto and google.api imports and options. The messages,
# field numbers and services stay as they are, so the generated C++ is wire-compatible with etcd.
# Usage: cmake -DIN=<file.proto> -DOUT=<file.proto> -P strip_etcd_proto.cmake
file(READ "${IN}" text)
string(REGEX REPLACE "import \"gogoproto/gogo.proto\";" "" text "${text}")
string(REGEX REPLACE "import \"google/api/annotations.proto\";" "" text "${text}")
string(REGEX REPLACE "option \\(gogoproto\\.[a-z_]+\\) = [a-z]+;" "" text "${text}")
# Field options such as [(gogoproto.nullable) = false].
string(REGEX REPLACE "\\[\\(gogoproto\\.[a-z_]+\\) = [^]]*\\]" "" text "${text}")
# HTTP gateway annotations: option (google.api.http) = { ... additional_bindings { ... } };
string(REGEX REPLACE "additional_bindings {[^}]*}" "" text "${text}")
string(REGEX REPLACE "option \\(google\\.api\\.http\\) = {[^}]*};" "" text "${text}")
file(WRITE "${OUT}" "${text}")
