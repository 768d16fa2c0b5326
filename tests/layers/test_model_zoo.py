"""The conformance suite (``tools/model_zoo.py``): every causal LM of transformers' auto mapping that
instantiates tiny on a CPU, loaded by trtvocab at tp 1 and tp 2 against transformers' own logits and
embedding rows. Never silently wrong: every type is exact, refused by name, or not instantiable; and
``docs/model_families.md`` is this run's table (for the transformers version it was generated with).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # every test here (docs/testing.md)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


@pytest.mark.ranks  # the tp 2 pass is one gloo group of two ranks
def test_no_family_is_silently_wrong_and_the_table_is_current(capsys) -> None:
    transformers = pytest.importorskip("transformers")
    import model_zoo

    results = model_zoo.run_zoo(timeout=120.0, log=sys.stderr)
    status = {mt: model_zoo.status(r) for mt, r in results.items()}
    wrong = {mt: model_zoo._reason(results[mt]) for mt, s in status.items() if s in ("wrong", "other")}
    assert not wrong, wrong
    ran = [mt for mt, r in results.items() if "tp1" in r]
    assert all("tp2" in results[mt] for mt in ran)  # every loadable type also ran split over two ranks
    exact = [mt for mt in ran if status[mt] == "exact"]
    assert len(exact) >= 0.9 * len(ran), (len(exact), len(ran))
    doc = (ROOT / "docs" / "model_families.md").read_text()
    if f"transformers {transformers.__version__}," not in doc:
        pytest.skip(f"docs/model_families.md was generated with another transformers than {transformers.__version__}")
    documented = dict(re.findall(r"^\| (\S+) \| [^|]* \| ([a-z ]+) \|", doc, re.M))
    # Not instantiable varies with the machine's time limit; every other status is as documented.
    changed = {mt: (documented.get(mt), s) for mt, s in status.items()
               if documented.get(mt) != s and "not instantiable" not in (s, documented.get(mt))}
    assert not changed, f"docs/model_families.md is out of date (python tools/model_zoo.py): {changed}"
