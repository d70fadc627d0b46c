#!/usr/bin/env bash
# Drives ddprun's bash completion as bash does at a TAB: COMP_LINE and COMP_POINT set, _ddprun
# called; prints "LINE => candidates" (sorted; "LINE =>" for none) for each line.
#   drive_bash.sh DDPRUN DIR LINE...   (DIR: where file names are completed from)
set -u
ddprun=$1
cd "$2" || exit 3
shift 2
# shellcheck disable=SC1090
source <("$ddprun" --print-completion bash) || exit 3
compopt() { :; } # bash's own takes effect only inside a completion it runs
for line in "$@"; do
  COMP_LINE=$line
  COMP_POINT=${#line}
  COMPREPLY=()
  _ddprun
  out="$line =>"
  while IFS= read -r c; do [ -z "$c" ] || out+=" $c"; done < <(printf '%s\n' "${COMPREPLY[@]}" | sort)
  echo "$out"
done
