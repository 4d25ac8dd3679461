"""ColdSnap inside the managers users already run. Each integration keeps the manager's scheduling, credentials
and transport and drives ColdSnap through its CLI (`coldsnap … --json`): one implementation of capture, admission,
restore and receipts, whoever asks."""
