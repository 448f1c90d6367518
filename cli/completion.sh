# Shell completion for `pd` (bash, zsh or fish). Source it from your shell's start-up file:
#     . path/to/pdtool/cli/completion.sh
# It asks click, which `pd` is built on, for the script that fits the running shell.
if ! command -v pd >/dev/null 2>&1; then
    :  # pd is not on the PATH (yet): nothing to complete
elif [ -n "${ZSH_VERSION:-}" ]; then
    eval "$(_PD_COMPLETE=zsh_source pd)"
elif [ -n "${BASH_VERSION:-}" ]; then
    eval "$(_PD_COMPLETE=bash_source pd)"
fi
# fish: run `_PD_COMPLETE=fish_source pd | source` in ~/.config/fish/completions/pd.fish
