"""Build ZeRO-3 yourself: the scaffold a learner's pieces plug into, and the live checks of each step.

    scaffold.py   Unit, Pieces, attach (the four moments as real hooks), Learner (an engine for the loop)
    checks.py     one check per build step, on real ranks, against the single-process oracle
    verdicts.py   from what the ranks measured to the sentence: what is right, or the mistake it names
    cells.py      the pieces notebook 02's `build` cells define (filled in the instructor's copy)
    stubs.py      what an unwritten build cell raises, and the sentence a check says of it
    reveal.py     labkit's own version of a piece, shown once the learner's build passed its checks
    learners_engine.py  the learner's engine for a run (02's pieces, 03's prefetch, 04's offload), refused
                  in one sentence before any run while a piece is a stub or fails its check
    yours.py      that engine in the later notebooks (04, 05, 07), and what it did beside the libraries
    fsdp2_check.py      notebook 05's build check: the learner's fully_shard calls on real ranks
    deepspeed_check.py  notebook 06's build check: the learner's ZeRO-3 config and training step
    prefetch_check.py   notebook 03's build check: the learner's 02 engine with prefetch, from its events
    offload_check.py    notebook 04's build check: the learner's 02 engine with its offloaded optimizer step

labkit.zero (the lab's own ZeRO-3) never imports this package.
"""

from labkit.buildalong.scaffold import Learner, Pieces, Unit, attach

__all__ = ["Learner", "Pieces", "Unit", "attach"]
