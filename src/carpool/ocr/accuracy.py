"""accuracy.py: character error rate of read lines against the rendered ones.

A rendered line is read as the text of the detected boxes whose centres lie inside its
ink box (widened by half its height), left to right, joined by spaces; a line no box
covers reads as empty, and the text of a box no line claims counts as inserted
characters. Spaces are compared collapsed (one space between words) and at neither end.
CER is the sum of edit distances over the sum of reference lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carpool.ocr.detect import Box
from carpool.ocr.render import TextLine


@dataclass(frozen=True, slots=True)
class Score:
    """Errors (edits) over reference characters, and lines read exactly."""

    errors: int = 0
    chars: int = 0
    lines: int = 0
    exact: int = 0

    @property
    def cer(self) -> float:
        return self.errors / self.chars if self.chars else 0.0

    def __add__(self, other: Score) -> Score:
        return Score(
            self.errors + other.errors,
            self.chars + other.chars,
            self.lines + other.lines,
            self.exact + other.exact,
        )


def normalise(text: str) -> str:
    return " ".join(text.split())


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def score_frame(lines: Sequence[TextLine], read: Sequence[tuple[Box, str]]) -> Score:
    """Score what was read in one frame (boxes and their texts) against its lines."""
    claimed: set[int] = set()
    total = Score()
    for line in lines:
        x0, y0, x1, y1 = line.box
        margin = (y1 - y0) / 2
        mine = [
            k
            for k, (box, _) in enumerate(read)
            if x0 - margin <= (box.x0 + box.x1) / 2 <= x1 + margin
            and y0 - margin <= (box.y0 + box.y1) / 2 <= y1 + margin
            and k not in claimed
        ]
        claimed.update(mine)
        got = normalise(" ".join(read[k][1] for k in sorted(mine, key=lambda k: read[k][0].x0)))
        want = normalise(line.text)
        errors = edit_distance(want, got)
        total += Score(errors, len(want), 1, int(errors == 0))
    stray = sum(len(normalise(text)) for k, (_, text) in enumerate(read) if k not in claimed)
    return total + Score(stray, 0, 0, 0)
