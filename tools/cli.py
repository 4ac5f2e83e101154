"""`quartctl`: the one command-line entry point of QUART-FaaS.

Each subcommand lives in the module of the component that owns it and is imported lazily, so
`quartctl --help` stays fast and a component's heavy imports (torch, deepspeed) load only when used.
A command target is ``"module:function"`` where ``function(argv: list[str]) -> int`` parses its own
arguments with argparse.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "partition": ("quart_tools.partition:main", "split a model into N pipeline stages (DeepSpeed partitioner)"),
    "demo": ("quart_tools.demo:main", "partition the small model, run it on the embedded gateway, show scaling"),
    "up": ("quart_tools.platform:up", "start the embedded OpenFaaS-compatible gateway and KeysManagers"),
    "down": ("quart_tools.platform:down", "stop everything `quartctl up` started"),
    "host": ("quart_tools.platform:host", "take a host's link down or up (`quartctl up --network netns`)"),
    "deploy": ("quart_tools.platform:deploy", "deploy a stack.yml through the gateway REST API (as faas-cli)"),
    "plugin": ("gateway_plugin.standalone:main", "run the gateway plugin as its own process in front of an OpenFaaS gateway"),
    "keysmanager": ("keysmanager.cli:main", "run one KeysManager host agent in the foreground"),
    "load": ("quart_tools.loadgen:main", "open-loop load generator (Poisson, gamma, trace replay)"),
    "report": ("quart_tools.report:main", "latency/SLO/goodput report and plots from request records"),
    "simulate": ("quart_tools.sim.cli:main", "cluster-scale discrete-event simulator and paper experiments"),
    "bench": ("quart_tools.bench:main", "run a named benchmark and write JSON"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: quartctl <command> [args...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`quartctl <command> --help` shows a command's options."]
    return "\n".join(lines)


def resolve(target: str):
    """Import ``module:function`` and return the function."""
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"quartctl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(resolve(COMMANDS[name][0])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
