"""Progress bars in log files: a non-TTY stderr gets a few lines, not one per update."""

import subprocess
import sys

SCRIPT = """
import time
from tasks.runtime.progress import progress_bar
bar = progress_bar(total=400, desc="scoring", enabled=True)
for _ in range(400):
    time.sleep(0.002)
    bar.update(1)
bar.close()
for _ in progress_bar(range(5), desc="off", enabled=False):
    pass
"""


def test_non_tty_progress_is_throttled(tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:  # a file: not a terminal, as under demo.sh > log or Prefect's capture
        subprocess.run([sys.executable, "-c", SCRIPT], stderr=err, check=True, timeout=120)
    text = log.read_text()
    refreshes = [r for r in text.replace("\r", "\n").split("\n") if "scoring" in r]
    # ~1.5 s of updates (a tqdm refresh each 0.1 s on a terminal): the first draw and the final one at most
    assert 1 <= len(refreshes) <= 3, refreshes
    assert "off" not in text  # a disabled bar writes nothing
