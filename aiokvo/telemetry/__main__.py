"""``python -m aiokvo.telemetry watch ...`` (see :mod:`aiokvo.telemetry.cli`)."""

from aiokvo.telemetry.cli import main

raise SystemExit(main())
