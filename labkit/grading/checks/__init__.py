"""What each exercise checks: one module per exercise id, each defining `EXERCISE` with `labkit.grading.kit`.

`labkit.grading.kit.load(exercise_id)` imports this package's module of that name. An exercise's checks may
keep a part in a module of their own beside it (`ex07_capstone_model.py`: the hidden model;
`ex*_reference.py`: the stand-ins for an answer that raises, `kit.stand_ins`); what the
public checks share with them lives in `labkit.grading` (`capstone`, `capstone_memory`, `gradients`); the
student release leaves out every `ex*.py` here (their hidden cases and reference judges).
"""
