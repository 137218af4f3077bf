"""Runs on the laptop (validate): a cluster config's shell commands read the way Ray's launcher
runs them: each entry of a command list in a new shell, split into simple commands, with the
environment each program starts with, and `ray start` / `mlflow server` found in them.

Pure text reading; nothing here runs a command or talks to Ray."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

# --- a config's command lists --------------------------------------------------------------

# Every list of shell commands the launcher runs on a node.
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")


def commands(config: dict[str, Any], key: str) -> str:
    """One string of the node's start commands (to search for flags; not for what runs in which
    shell: see simple_commands)."""
    return "\n".join(str(command) for command in config.get(key, []) or [])


def flag_value(script: str, flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in a command string."""
    match = re.search(rf"{re.escape(flag)}[ =]+([^\s;]+)", script)
    return match.group(1) if match else None


# --- one launcher command, as the shell runs it --------------------------------------------
# Ray's launcher runs each entry of a command list in a new shell: a variable exported in one
# entry never reaches `ray start` in another. These read one entry at a time.

SUBSTITUTION = "$__substituted__"  # stands for $(...) and `...`: a value computed on the node
_OPERATORS = re.compile(r"&&|\|\||>>|>&|&>|<<|[;&|()<>\n]")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Wrappers that run the next word as the command, with the same environment.
_WRAPPERS = {"nohup", "exec", "time", "command"}
_SHELLS = {"bash", "sh", "dash", "zsh"}


@dataclass(frozen=True)
class SimpleCommand:
    """One simple command: `NAME=value ... program args > target`, and what joined it to the
    one before (`;`, `&&`, `||`, `|`, `&`, a newline, or '' at the start)."""
    assignments: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    redirects: tuple[str, ...]
    joined_by: str = ""


def _without_substitutions(text: str) -> str:
    """`$(...)` and backquotes replaced by SUBSTITUTION, so that a `|` or `;` inside them does not
    split the command around them."""
    out, i, quote = [], 0, ""
    while i < len(text):
        char = text[i]
        if quote != "'" and text.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            out.append(SUBSTITUTION)
            i = j
            continue
        if quote != "'" and char == "`":
            end = text.find("`", i + 1)
            out.append(SUBSTITUTION)
            i = len(text) if end < 0 else end + 1
            continue
        if char in "'\"" and quote in ("", char):
            quote = "" if quote else char
        elif char == "\\" and quote != "'":
            out.append(text[i:i + 2])
            i += 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(_without_substitutions(command.replace("\\\n", " ")), posix=True,
                        punctuation_chars=";&|()<>\n")
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    try:
        raw = list(lexer)
    except ValueError:  # an unclosed quote: the shell would refuse it too; read it as words
        raw = command.split()
    tokens = []
    for token in raw:
        if token and set(token) <= set(";&|()<>\n"):
            tokens += _OPERATORS.findall(token)
        else:
            tokens.append(token)
    return tokens


def shell_items(command: str) -> Iterator[SimpleCommand | str]:
    """The simple commands of one launcher command in order, with '(' and ')' where a subshell
    starts and ends (what is exported inside one does not outlive it)."""
    words, redirects, joined_by, target_next = [], [], "", False

    def flush() -> Iterator[SimpleCommand]:
        if words or redirects:
            count = next((i for i, w in enumerate(words) if not _ASSIGNMENT.match(w)), len(words))
            assignments = tuple(tuple(w.split("=", 1)) for w in words[:count])
            yield SimpleCommand(assignments, tuple(words[count:]), tuple(redirects), joined_by)
        words.clear()
        redirects.clear()

    for token in _tokens(command):
        if target_next:
            redirects.append(token)
            target_next = False
        elif token in (">", ">>", "&>", "<", "<<", ">&"):
            target_next = token != "<<"
            if token == ">&" and words and words[-1].isdigit():
                words.pop()  # 2>&1: the 2 belongs to the redirection
        elif token in ("(", ")"):
            yield from flush()
            yield token
            joined_by = ""
        elif token in (";", "&&", "||", "|", "&", "\n"):
            yield from flush()
            joined_by = token
        else:
            words.append(token)
    yield from flush()


def simple_commands(command: str) -> list[SimpleCommand]:
    return [item for item in shell_items(command) if isinstance(item, SimpleCommand)]


def program(simple: SimpleCommand) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """(environment changes, argv) of what actually runs: `env NAME=value -u NAME prog`, `nohup
    prog` and the like are unwrapped; None marks a variable removed."""
    changes: dict[str, str | None] = dict(simple.assignments)
    argv = list(simple.argv)
    while argv:
        name = os.path.basename(argv[0])
        if name in _WRAPPERS:
            argv = argv[1:]
        elif name == "env":
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or _ASSIGNMENT.match(argv[0])):
                word = argv.pop(0)
                if word in ("-u", "--unset") and argv:
                    changes[argv.pop(0)] = None
                elif _ASSIGNMENT.match(word):
                    key, value = word.split("=", 1)
                    changes[key] = value
        else:
            break
    return changes, tuple(argv)


def is_ray_start(argv: tuple[str, ...]) -> bool:
    return len(argv) >= 2 and os.path.basename(argv[0]) == "ray" and argv[1] == "start"


def is_mlflow_server(argv: tuple[str, ...]) -> bool:
    if len(argv) >= 3 and os.path.basename(argv[0]).startswith("python") and argv[1:3] == ("-m", "mlflow"):
        argv = argv[2:]
    return len(argv) >= 2 and os.path.basename(argv[0]) == "mlflow" and argv[1] in ("server", "ui")


def option(argv: tuple[str, ...], *names: str) -> str | None:
    """The value of `--name value`, `--name=value` or `-n value` in one command's argv (the last
    one wins, as with click)."""
    value = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(name + "=") and name.startswith("--"):
                value = word[len(name) + 1:]
    return value


def env_at(command: str, runs: Callable[[tuple[str, ...]], bool],
           initial: Mapping[str, str] | None = None) -> list[tuple[tuple[str, ...], dict[str, str]]]:
    """(argv, exported environment) of each program in this one command for which runs(argv)
    is true, starting from a new shell's environment `initial` (the container's, if any)."""
    exported, shell_vars, marked, saved, seen = dict(initial or {}), {}, set(), [], []
    for item in shell_items(command):
        if item == "(":
            saved.append((dict(exported), dict(shell_vars), set(marked)))
            continue
        if item == ")":
            exported, shell_vars, marked = saved.pop() if saved else (exported, shell_vars, marked)
            continue
        changes, argv = program(item)
        if not item.argv:  # NAME=value alone: a shell variable, exported only if marked for export
            for key, value in item.assignments:
                shell_vars[key] = value
                if key in exported or key in marked:
                    exported[key] = value
        elif argv[:1] == ("export",):
            for word in argv[1:]:
                key, _, value = word.partition("=")
                if "=" in word or key in shell_vars:
                    exported[key] = value if "=" in word else shell_vars[key]
                else:
                    marked.add(key)
        elif argv[:1] == ("unset",):
            for name in argv[1:]:
                exported.pop(name, None)
                shell_vars.pop(name, None)
                marked.discard(name)
        elif runs(argv):
            env = {**exported, **changes}
            seen.append((argv, {key: value for key, value in env.items() if value is not None}))
        elif argv and os.path.basename(argv[0]) in _SHELLS and option(argv, "-c"):  # bash -c '...'
            env = {key: value for key, value in {**exported, **changes}.items() if value is not None}
            seen += env_at(option(argv, "-c") or "", runs, env)
    return seen


def auth_mode_at_ray_start(command: str, initial: Mapping[str, str] | None = None) -> list[str | None]:
    """RAY_AUTH_MODE as each `ray start` in this one command sees it (None: not set)."""
    return [env.get("RAY_AUTH_MODE") for _, env in env_at(command, is_ray_start, initial)]


def exports_auth_token(command: str, initial: Mapping[str, str] | None = None) -> bool:
    """This one command runs `ray start`, and every `ray start` in it runs with RAY_AUTH_MODE=token."""
    modes = auth_mode_at_ray_start(command, initial)
    return bool(modes) and all(mode == "token" for mode in modes)


# --- the environment a node's commands start with ------------------------------------------


def container_env(config: dict, role: str) -> dict[str, str]:
    """Variables every command of a node of this role starts with: `--env`/`-e` in the docker
    run options (commands run inside the container when there is one)."""
    docker = config.get("docker") or {}
    if not (docker.get("image") or docker.get(f"{role}_image")):
        return {}
    options = " ".join(str(o) for o in [*(docker.get("run_options") or []), *(docker.get(f"{role}_run_options") or [])])
    try:
        words = shlex.split(options)
    except ValueError:  # an unclosed quote: docker would refuse it too
        words = options.split()
    env = {}
    for i, word in enumerate(words):
        value = (words[i + 1] if word in ("-e", "--env") and i + 1 < len(words)
                 else word[len("--env="):] if word.startswith("--env=") else "")
        if "=" in value:
            key, value = value.split("=", 1)
            env[key] = value
    return env
