#!/usr/bin/env zsh
# Drives ddprun's zsh completion in a real interactive zsh on a pseudo-terminal (zsh/zpty): each
# line is typed, completed (a widget bound to ^T runs zsh's completion system), and the
# candidates zsh's compadd was given are printed as "LINE => candidates" (sorted; "LINE =>"
# for none).
#   drive_zsh.zsh DDPRUN DIR LINE...   (DIR: where file names are completed from)
emulate -L zsh
zmodload zsh/zpty || exit 3
ddprun=$1
cd $2 || exit 3
shift 2
$ddprun --print-completion zsh > ./_ddprun || exit 3
zpty z zsh -f -i || exit 3
zpty -w z "PROMPT='> '; autoload -Uz compinit; compinit -u -D; source ./_ddprun"
zpty -w z 'compadd() { builtin compadd -O __hits "$@"; local h; for h in $__hits; do print -r -- "HIT<$h>"; done; builtin compadd "$@" }'
zpty -w z 'zle -C __c complete-word _main_complete; bindkey "^T" __c'
# Reads what the terminal shows until `text` appears (at most ~10 s); the whole of it in $seen.
seen=
await() {
  local out
  integer tries=0
  seen=
  while [[ $seen != *$1* ]] && (( tries++ < 200 )); do
    zpty -r -t z out && seen+=$out || sleep 0.05
  done
}
# Waits for the shell to have run all it was sent: a mark only the command's output spells.
integer marks=1000
settle() {
  (( marks++ ))
  zpty -w z "print MARK\$(( $marks + 1 ))"
  await "MARK$(( marks + 1 ))"
}
settle
for line in "$@"; do
  # Typed at an idle prompt (zsh drops what is typed ahead of a prompt), completed with ^T, then
  # the line cleared (^U); what compadd was given is printed by the completion itself.
  zpty -w -n z "ddprun ${line#ddprun }"$'\x14'
  sleep 0.3
  zpty -w -n z $'\x15'
  settle
  local hits=(${(M)${(s: :)${seen//[$'\r\n']/ }}:#*HIT<*>*})
  hits=(${(ou)${${hits#*HIT<}%%>*}})
  print -r -- "$line =>${hits:+ ${(j: :)hits}}"
done
zpty -d z
