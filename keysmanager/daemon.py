"""``python -m keysmanager.daemon``: the KeysManager process entry (kept for its callers; see ``keysmanager.cli``).

The host agent itself is ``keysmanager.manager.KeysManager``; the process around it ``keysmanager.server``.
"""

from __future__ import annotations

import sys

from keysmanager.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
