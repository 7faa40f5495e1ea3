"""The studies run as scripts from research/ and import each other by module name
(``from accuracy_sweep import load_source``, ``from rope import rotate``): their tests see the
same path."""
import sys
from pathlib import Path

_RESEARCH = str(Path(__file__).resolve().parents[1])
if _RESEARCH not in sys.path:
    sys.path.insert(0, _RESEARCH)
