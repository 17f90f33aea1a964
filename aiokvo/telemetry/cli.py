"""``aiokvo`` / ``python -m aiokvo.telemetry``: command-line tools (``watch``, ``replay``,
``disk``)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from aiokvo.errors import ConfigError

__all__ = ["main"]

_EPILOG = """examples:
  aiokvo watch --metrics http://127.0.0.1:9400/metrics
  aiokvo watch --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
  aiokvo watch --metrics http://host:9400/metrics --duration 60 --plain >> cache.log
"""


def _parser() -> argparse.ArgumentParser:
    from aiokvo import __version__

    parser = argparse.ArgumentParser(prog="aiokvo", description="aiokvo's command-line tools")
    parser.add_argument("--version", action="version", version=f"aiokvo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    watch = commands.add_parser(
        "watch", help="a live view of a running process's cache",
        description="Show hit rates, GB/s each way, pool usage and evictions per tier, "
                    "from a metrics endpoint and/or a KV-event publisher.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    watch.add_argument("--metrics", action="append", default=[], metavar="URL",
                       help="an aiokvo metrics endpoint to scrape (repeatable)")
    watch.add_argument("--events", metavar="ENDPOINT",
                       help="a KV-event publisher's PUB endpoint to subscribe to")
    watch.add_argument("--replay", metavar="ENDPOINT",
                       help="its replay (ROUTER) endpoint, to start from what is cached")
    watch.add_argument("--topic", default="", help="the KV-event topic prefix (default: all)")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    watch.add_argument("--duration", type=float, default=None,
                       help="stop after this many seconds (default: until interrupted)")
    watch.add_argument("--plain", action="store_true",
                       help="plain lines even on a terminal (the default when piped)")
    from aiokvo.lab.cli import add_replay_command  # the policy lab: aiokvo replay

    add_replay_command(commands)
    from aiokvo.tiers.disk.cli import add_disk_command  # aiokvo disk ls / prune

    add_disk_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("replay", "disk"):
        return int(args.handler(args))
    from aiokvo.telemetry.watch import watch

    try:
        return asyncio.run(watch(
            metrics=args.metrics, events=args.events, replay=args.replay, topic=args.topic,
            interval=args.interval, duration=args.duration, plain=args.plain,
        ))
    except ConfigError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        return 0
    except ImportError as exc:
        parser.exit(2, f"aiokvo watch: {exc} (pip install 'aiokvo[watch]')\n")
