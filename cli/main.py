"""``gpuwatch``: one command for the product. Every subcommand lives with its part (the agent's in
``gpuwatch.agent.cli``, the trainer's in ``gpuwatch.trainer.cli`` ...) and is imported only when invoked, so
the agent runs on nodes without torch, and ``gpuwatch --help`` costs no import of any of them."""

from __future__ import annotations

import importlib

import click

from gpuwatch.agent import __version__


class LazyGroup(click.Group):
    """A click group whose subcommands live in modules imported on first use."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return super().get_command(ctx, name)
        module_name, attribute = self.lazy[name]
        return getattr(importlib.import_module(module_name), attribute)


@click.group(
    cls=LazyGroup,
    lazy={"agent": ("gpuwatch.agent.cli", "agent"), "train": ("gpuwatch.trainer.cli", "train"),
          "diagnose": ("gpuwatch.diagnosis.cli", "diagnose"), "probe": ("gpuwatch.trainer.probe", "probe"),
          "alerts": ("gpuwatch.alerts.cli", "alerts"),
          "dashboards": ("gpuwatch.dashboards.cli", "dashboards"), "demo": ("gpuwatch.cli.demo", "demo"),
          "run": ("gpuwatch.cli.run", "run"), "plan": ("gpuwatch.cli.plan", "plan"),
          "report": ("gpuwatch.report.cli", "report"),
          "calibrate": ("gpuwatch.plan.cli", "calibrate_command")},
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="gpuwatch")
def main() -> None:
    """Observability and diagnosis for multi-node GPU training."""


if __name__ == "__main__":
    main()
