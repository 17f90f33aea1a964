"""``aiokvo disk ls ROOT`` / ``aiokvo disk prune ROOT [--dry-run]`` (see :mod:`.admin`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from aiokvo.errors import ConfigError, UnsafeFileError

__all__ = ["add_disk_command", "run_disk"]

_EPILOG = """examples:
  aiokvo disk ls /var/cache/aiokvo
  aiokvo disk prune /var/cache/aiokvo --dry-run
  aiokvo disk prune /var/cache/aiokvo
"""


def add_disk_command(commands: Any) -> None:
    """Register ``disk`` (``ls``, ``prune``) on an ``argparse`` subparsers object."""
    parser = commands.add_parser(
        "disk", help="list or prune a disk tier's layouts",
        description="List a disk tier root's layout directories (fingerprint, slabs, blocks, "
                    "bytes, writers, last use), or remove those no live process writes.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    actions = parser.add_subparsers(dest="disk_command", required=True)
    ls = actions.add_parser("ls", help="list the layouts under ROOT")
    ls.add_argument("root", help="the disk tier's root directory")
    ls.add_argument("--json", action="store_true", help="one JSON object per layout")
    prune = actions.add_parser("prune", help="remove the layouts no live process writes")
    prune.add_argument("root", help="the disk tier's root directory")
    prune.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    prune.add_argument("--json", action="store_true", help="one JSON object per layout")
    parser.set_defaults(handler=run_disk)


def run_disk(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``disk ls`` or ``disk prune``; 0, or 2 for a root it will not read."""
    from aiokvo.tiers.disk.admin import list_layouts, prune_layouts

    out = sys.stdout if out is None else out
    try:
        if args.disk_command == "ls":
            layouts, skipped = list_layouts(args.root)
            verb = None
        else:
            layouts, skipped = prune_layouts(args.root, dry_run=args.dry_run)
            verb = "would remove" if args.dry_run else "removed"
    except (ConfigError, UnsafeFileError) as exc:
        print(f"aiokvo disk: {exc}", file=sys.stderr)
        return 2
    now = time.time()
    for layout in layouts:
        last = layout.last_use
        if args.json:
            row: dict[str, Any] = {
                "layout": layout.name, "path": str(layout.path), "slabs": len(layout.slabs),
                "blocks": layout.blocks, "disk_bytes": layout.disk_bytes,
                "writers": list(layout.writers), "last_use": last,
                "damaged": sum(s.damaged for s in layout.slabs),
            }  # fmt: skip
            if verb is not None:
                row["action"] = verb.replace(" ", "_")
            print(json.dumps(row), file=out)
            continue
        writers = ",".join(map(str, layout.writers)) or "-"
        age = "-" if last is None else f"{max(0.0, now - last):.0f}s ago"
        prefix = "" if verb is None else f"{verb} "
        print(f"{prefix}{layout.name}  slabs {len(layout.slabs)}  blocks {layout.blocks}  "
              f"{layout.disk_bytes / 2**20:.1f} MiB  writers {writers}  last use {age}",
              file=out)  # fmt: skip
    for skip in skipped:
        if args.json:
            print(json.dumps({"skipped": str(skip.path), "reason": skip.reason}), file=out)
        else:
            print(f"skipped {skip.path}: {skip.reason}", file=out)
    return 0
