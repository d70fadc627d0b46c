#!/usr/bin/env python3
"""Every Catch2 test name is one ctest can register and run: CMake's catch_discover_tests reads a
name with '[' or ']' (a Catch tag, a CMake bracket), ';' (a CMake list separator) or '\\'
wrongly, and then silently drops the tests listed after it (a name with "[from, to)" once took
34 rendezvous state tests out of CI); a name starting with '~', '#' or 'exclude:', or starting
or ending with '*', is a test spec of its own, not that test. The check first judges a few names
of its own, so that it can fail.

    check_test_names.py ROOT    exit 0, or 1 naming each file:line and name
"""
import os
import re
import sys

# TEST_CASE( then one or more adjacent string literals (the name), possibly over several lines.
TEST_CASE = re.compile(
    r'\b(?:TEMPLATE_(?:PRODUCT_|LIST_)?TEST_CASE(?:_METHOD)?(?:_SIG)?|TEST_CASE_METHOD|TEST_CASE|'
    r'SCENARIO)\s*\(\s*(?:[\w:<>, ]+?\s*,\s*)?((?:"(?:[^"\\]|\\.)*"\s*)+)')
LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')
BAD = re.compile(r'[\[\];\\]|^[~#*]|^exclude:|\*$')


def bad_names(text):
    """(line, name) of every test name in `text` that ctest cannot register."""
    out = []
    for m in TEST_CASE.finditer(text):
        name = "".join(LITERAL.findall(m.group(1)))
        if BAD.search(name):
            out.append((text.count("\n", 0, m.start()) + 1, name))
    return out


def self_test():
    cases = [
        ('TEST_CASE("a plain name, with a comma", "[tag]") {}', 0),
        ('TEST_CASE(\n    "keys in [from, to) "\n    "are deleted", "[state]") {}', 1),
        ('TEST_CASE("a; b", "[x]") {}', 1),
        ('TEST_CASE_METHOD(Fixture, "a \\\\ b", "[x]") {}', 1),
        ('TEST_CASE("split " "over [two]", "[x]") {}', 1),
        ('SCENARIO("a [scenario]", "[x]") {}', 1),
        ('TEMPLATE_TEST_CASE("typed [T]", "[x]", int, float) {}', 1),
        ('TEST_CASE_METHOD(ns::Fixture<int>, "fixed;", "[x]") {}', 1),
        ('TEST_CASE("~not this", "[x]") {}', 1),
        ('TEST_CASE("all of it*", "[x]") {}', 1),
        ('TEST_CASE("a * in the middle is fine", "[x]") {}', 0),
    ]
    for text, expected in cases:
        if len(bad_names(text)) != expected:
            print(f"check_test_names: judged wrongly: {text!r}")
            return False
    return True


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    if not self_test():
        return 1
    root = sys.argv[1]
    failures = []
    for top in ("tests", "fuzz"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith((".cc", ".h")):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8", errors="replace") as src:
                    for line, name in bad_names(src.read()):
                        failures.append(f"{os.path.relpath(path, root)}:{line}: {name!r}")
    for f in failures:
        print(f"test name ctest cannot register or run alone ('[', ']', ';', '\\', a leading '~', "
              f"'#', 'exclude:' or '*', a trailing '*'): {f}")
    if failures:
        return 1
    print("test names: every Catch2 test name can be registered by ctest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
