"""The engine object and its request path: intake, the plan -> prefill -> commit step, the scheduler, sequences, sampling and stats."""
