"""Another engine replica, in its own process: store blocks into a Mooncake cluster.

``python -m tests.tiers.mooncake._replica --master H:P --metadata M a b c``
stores the blocks of keys ``a b c`` (``tests.offloader._harness.keys``; their
bytes are a function of the key, so the test can check them) through an
Offloader with a Mooncake tier, waits for the write-through, and prints one
JSON line with its tier's statistics.
"""

from __future__ import annotations

import argparse
import json
import sys

import aiokvo
from aiokvo.tiers.mooncake import MooncakeTier
from tests.offloader._harness import KV, keys
from tests.tiers.mooncake._support import mooncake_stats, replica


async def store(args: argparse.Namespace) -> dict[str, object]:
    ks = keys(*args.names)
    kv = KV(64)
    tier = MooncakeTier(
        args.master, model_id="test-model", metadata_server=args.metadata,
        local_hostname="127.0.0.1",
    )  # fmt: skip
    async with replica(tier, kv, cpu_blocks=32) as off:
        blocks = list(range(len(ks)))
        kv.write(blocks, ks)
        await off.store(ks, blocks)
        await off.drain()
        stats = mooncake_stats(off)
    return {"blocks_written": stats.blocks_written, "write_failures": stats.write_failures,
            "connected": stats.connected, "hostname": tier.store.hostname}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("names", nargs="+")
    print(json.dumps(aiokvo.run(store(parser.parse_args()))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
