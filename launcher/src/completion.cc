// Shell completion scripts for ddprun (--print-completion), generated from the flag table
// (common/launch_flags.h), so they offer what the parser takes. torchrun derives its scripts from
// its argparse parser with the optional shtab package; ddprun needs nothing installed.
#include <string>
#include <vector>

#include "ddprun/common/launch_flags.h"
#include "ddprun/common/strings.h"
#include "ddprun/launcher/cli.h"

namespace ddprun::launcher {
namespace {

bool takesDirectory(const LaunchFlag& f) {
  return f.metavar != nullptr && std::string(f.metavar) == "DIR";
}

// The first sentence of a flag's help: what a completion menu shows beside it.
std::string summary(const LaunchFlag& f) {
  std::string h = f.help;
  if (auto dot = h.find(". "); dot != std::string::npos) h = h.substr(0, dot + 1);
  return h;
}

// A flag's fixed values as one shell word list: "a b c".
std::string choiceWords(const LaunchFlag& f) { return replaceAll(f.choices, ",", " "); }

// Inside a single-quoted shell word.
std::string singleQuoted(const std::string& s) { return replaceAll(s, "'", "'\\''"); }

std::string bashScript() {
  std::string opts = "-h --help";
  std::string takes;
  std::string cases;
  for (const auto& f : launchFlags()) {
    const std::string dashed = dashedFlagName(f.name);
    opts += " " + dashed;
    if (f.short_name != 0) opts += std::string(" -") + f.short_name;
    if (!f.takes_value) continue;
    takes += " " + dashed;
    if (f.short_name != 0) takes += std::string(" -") + f.short_name;
    if (f.choices != nullptr) {
      cases +=
          "    " + dashed + ") COMPREPLY=($(compgen -W '" + choiceWords(f) + "' -- \"$2\")) ;;\n";
    } else if (takesDirectory(f)) {
      cases += "    " + dashed + ") compopt -o filenames; COMPREPLY=($(compgen -d -- \"$2\")) ;;\n";
    }
  }
  return "# bash completion for ddprun (ddprun --print-completion bash): source it, or save it as\n"
         "# ~/.local/share/bash-completion/completions/ddprun\n"
         "_ddprun_value() {  # flag value-so-far\n"
         "  case $1 in\n" +
         cases +
         "    *) COMPREPLY=() ;;\n"
         "  esac\n"
         "}\n"
         "_ddprun() {\n"
         "  # Words split at blanks only: '=' and ':' are part of ddprun's words.\n"
         "  local line=${COMP_LINE:0:COMP_POINT} cur= w flag skip=0 i=1\n"
         "  local -a words\n"
         "  read -ra words <<< \"$line\"\n"
         "  if [[ -n $line && $line != *[[:space:]] ]]; then\n"
         "    cur=${words[${#words[@]}-1]}\n"
         "    unset 'words[${#words[@]}-1]'\n"
         "  fi\n"
         "  local takes=' " +
         takes +
         " '\n"
         "  if [[ ${words[1]-} == launch || ${words[1]-} == slurm ]]; then i=2; fi\n"
         "  for ((; i < ${#words[@]}; i++)); do\n"
         "    w=${words[i]}\n"
         "    if ((skip)); then skip=0; continue; fi\n"
         "    case $w in\n"
         "      --) compopt -o filenames; COMPREPLY=($(compgen -f -- \"$cur\")); return ;;\n"
         "      -*) flag=${w%%=*}; flag=${flag//_/-}\n"
         "          if [[ $w != *=* && $takes == *\" $flag \"* ]]; then skip=1; fi ;;\n"
         "      *) compopt -o filenames; COMPREPLY=($(compgen -f -- \"$cur\")); return ;;\n"
         "    esac\n"
         "  done\n"
         "  if ((skip)); then\n"
         "    flag=${words[${#words[@]}-1]}\n"
         "    _ddprun_value \"${flag//_/-}\" \"$cur\"\n"
         "  elif [[ $cur == -*=* ]]; then\n"
         "    flag=${cur%%=*}\n"
         "    _ddprun_value \"${flag//_/-}\" \"${cur#*=}\"\n"
         "  elif [[ $cur == -* ]]; then\n"
         "    COMPREPLY=($(compgen -W '" +
         opts +
         "' -- \"$cur\"))\n"
         "  elif ((${#words[@]} == 1)); then\n"
         "    compopt -o filenames\n"
         "    COMPREPLY=($(compgen -W 'launch slurm' -- \"$cur\") $(compgen -f -- \"$cur\"))\n"
         "  else\n"
         "    compopt -o filenames; COMPREPLY=($(compgen -f -- \"$cur\"))\n"
         "  fi\n"
         "}\n"
         "complete -F _ddprun ddprun\n";
}

// zsh's _arguments: brackets and colons in a description are escaped.
std::string zshText(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '[' || c == ']' || c == ':' || c == '\\') out += '\\';
    out += c;
  }
  return singleQuoted(out);
}

std::string zshScript() {
  std::string specs;
  for (const auto& f : launchFlags()) {
    // After the names: [description] and, for a flag with a value, :message:action.
    std::string tail = "[" + zshText(summary(f)) + "]";
    if (f.takes_value) {
      std::string action = " ";
      if (f.choices != nullptr) action = "(" + choiceWords(f) + ")";
      if (takesDirectory(f)) action = "_files -/";
      tail += ":" + zshText(f.metavar) + ":" + action;
    }
    const std::string dashed = dashedFlagName(f.name);
    const std::string underscored = "--" + std::string(f.name);
    const std::string eq = f.takes_value ? "=" : "";
    // Brace expansion happens outside the quotes: {--a-b,--a_b}'=[...]'.
    const std::string names =
        underscored == dashed ? "'" + dashed : "{" + dashed + "," + underscored + "}'";
    specs += "    " + names + eq + tail + "' \\\n";
    if (f.short_name != 0) {
      specs += std::string("    '-") + f.short_name + (f.takes_value ? "+" : "") + tail + "' \\\n";
    }
  }
  return "#compdef ddprun\n"
         "# zsh completion for ddprun (ddprun --print-completion zsh): save it as _ddprun in a\n"
         "# directory of $fpath (e.g. ~/.zsh/completions), or source it after compinit\n"
         "_ddprun() {\n"
         "  _arguments -S \\\n"
         "    '(- *)'{-h,--help}'[show the help and exit]' \\\n" +
         specs +
         "    '1:training script:_files' \\\n"
         "    '*::training script arguments:_files'\n"
         "}\n"
         "if [[ $zsh_eval_context[-1] == loadautofunc ]]; then\n"
         "  _ddprun \"$@\"\n"
         "else\n"
         "  compdef _ddprun ddprun\n"
         "fi\n";
}

std::string tcshScript() {
  std::string words;
  std::string values;
  std::string shorts = "h";
  for (const auto& f : launchFlags()) {
    if (f.short_name != 0) shorts += std::string(" ") + f.short_name;
    std::string name = dashedFlagName(f.name).substr(2);
    words += " " + name;
    if (f.choices != nullptr) {
      const std::string list = "(" + choiceWords(f) + ")";
      values += " 'c/--" + name + "=/" + list + "/' 'n/--" + name + "/" + list + "/'";
    } else if (takesDirectory(f)) {
      values += " 'c/--" + name + "=/d/' 'n/--" + name + "/d/'";
    }
  }
  return "# tcsh completion for ddprun (ddprun --print-completion tcsh): source it from ~/.tcshrc\n"
         "complete ddprun" +
         values + " 'c/--/(help" + words + ")/' 'c/-/(" + shorts + " -)/' 'n/-r/(0 1 2 3)/' " +
         "'n/-t/(0 1 2 3)/' 'p/1/(launch slurm)/' 'p/*/f/'\n";
}

}  // namespace

std::string completionScript(const std::string& shell) {
  if (shell == "zsh") return zshScript();
  if (shell == "tcsh") return tcshScript();
  return bashScript();
}

}  // namespace ddprun::launcher
