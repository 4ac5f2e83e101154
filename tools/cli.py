"""`quartctl`: the one command-line entry point of QUART-FaaS (on click).

The management commands (``status``, ``list``, ``logs``, ``invoke``, ``scale``, ``rm``) are click commands
(:mod:`quart_tools.manage`). The others live in the module of the component that owns them, parse their own
arguments with argparse (``quart_stage.cliargs``: one-line errors, exit 2) and are imported lazily, so
``quartctl --help`` stays fast and a component's heavy imports (torch, deepspeed) load only when used. A
target is ``"module:function"`` where ``function(argv: list[str]) -> int``.

Every usage error is one line on stderr and exit code 2; ``--version`` prints the installed version.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

import click
from quart_tools.manage import COMMANDS as MANAGE_COMMANDS

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
    "report": ("quart_tools.report:main", "latency/SLO/goodput report and plots from request records; `report benchmarks`: docs/benchmarks.md's tables from docs/data"),
    "simulate": ("quart_tools.sim.cli:main", "cluster-scale discrete-event simulator and paper experiments"),
    "bench": ("quart_tools.bench:main", "run a named benchmark and write JSON"),
}


def version() -> str:
    try:
        return metadata.version("quart-faas")
    except metadata.PackageNotFoundError:  # run from a source tree without an install
        return "0.1.0+source"


def resolve(target: str):
    """Import ``module:function`` and return the function."""
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def argparse_command(name: str, target: str, help_: str) -> click.Command:
    """A click command that hands its raw arguments (``--help`` included) to ``target``'s own argparse."""

    @click.command(name, help=f"{help_} (`quartctl {name} --help` for its options)", short_help=help_,
                   add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        sys.exit(int(resolve(target)(list(args)) or 0))

    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version(), "--version", prog_name="quartctl", message="%(prog)s %(version)s")
def cli() -> None:
    """QUART-FaaS: key-stage autoscaling for pipelined model serving on OpenFaaS.

    `quartctl <command> --help` shows a command's options.
    """


for _name, (_target, _help) in COMMANDS.items():
    cli.add_command(argparse_command(_name, _target, _help))
for _command in MANAGE_COMMANDS:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> int:
    """Run quartctl; usage errors are one line (``quartctl <command>: error: ...``) and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = cli.main(args=argv, prog_name="quartctl", standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "quartctl"
        click.echo(f"{where}: error: {exc.format_message()} (see `{where} --help`)", err=True)
        return 2
    except click.ClickException as exc:
        command = next((a for a in argv if a in cli.commands), "")
        click.echo(f"quartctl{' ' + command if command else ''}: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("quartctl: aborted", err=True)
        return 1
    except SystemExit as exc:  # an argparse command's exit code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
