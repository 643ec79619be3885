"""The round-trip model of ``tools/kernel_sass.py``: the scheduling controls read from an
instruction's encoding, and the replay of a loop body by a lone warp. Pure Python (no Triton,
no compiler): the lines are ``nvdisasm -hex`` output of an sm_90 cubin."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from kernel_sass import Scheduled, _scheduled, replay  # noqa: E402

# three instructions of the integer GEMV's loop (Triton 3.9, sm_90), each line followed by the
# upper half of its encoding: a load that releases scoreboard 2 when its result arrives, one
# that releases 0 once its address registers are read, and an IMAD that waits on 0
LINES = """\
        /*0850*/                   LDG.E.64 R112, desc[UR6][R8.64+0x100] ;             /* 0x0001000608707981 */
                                                                                       /* 0x000ea8000c1e1b00 */
        /*0960*/                   LDG.E.U16.CONSTANT R14, desc[UR6][R40.64] ;         /* 0x00000006280e7981 */
                                                                                       /* 0x000162000c1e9500 */
        /*0a20*/                   IMAD.WIDE.U32 R40, R133, 0x4, R82 ;                 /* 0x0000000485287825 */
                                                                                       /* 0x001fcc00078e0052 */
""".splitlines()  # noqa: E501


def test_the_controls_are_read_from_the_encodings_upper_half():
    load, constant, imad = _scheduled(LINES)
    assert load == Scheduled("LDG.E.64", stall=4, writes=2, reads=None, waits=0)
    assert constant == Scheduled("LDG.E.U16.CONSTANT", stall=1, writes=5, reads=0, waits=0)
    # the IMAD overwrites R40, the address the second load reads: it waits on scoreboard 0
    assert imad == Scheduled("IMAD.WIDE.U32", stall=6, writes=None, reads=None, waits=0b1)


def _load(scoreboard):
    return Scheduled("LDG.E.128", stall=1, writes=scoreboard, reads=None, waits=0)


def _use(scoreboards):
    return Scheduled("FFMA", stall=1, writes=None, reads=None, waits=scoreboards)


def test_loads_issued_together_wait_once_and_a_dependent_load_waits_again():
    together = [_load(2), _load(3), _use(0b100), _use(0b1000)]
    trips, cycles = replay(together, latency=800)
    assert trips == 1 and 800 <= cycles < 900, (trips, cycles)
    # the second load issued only after the first's value was used: two round trips
    chained = [_load(2), _use(0b100), _load(3), _use(0b1000)]
    trips, cycles = replay(chained, latency=800)
    assert trips == 2 and 1600 <= cycles < 1700, (trips, cycles)
    # no wait at all: issue only
    assert replay([_use(0), _use(0)], latency=800) == (0, 2)


def test_a_load_issued_an_iteration_ahead_does_not_wait():
    """A prefetch: the loop uses the value loaded in the iteration before, then loads the next
    one; with more issue than the latency between them there is no wait, with less one."""
    body = [_use(0b100), _load(2), *[_use(0)] * 900]
    assert replay(body, latency=800) == (0, 902)
    trips, cycles = replay([_use(0b100), _load(2), *[_use(0)] * 500], latency=800)
    assert trips == 1 and cycles == 801, (trips, cycles)
