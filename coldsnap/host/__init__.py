"""This host: what a restore depends on (profile), whether it can capture and restore (doctor), what this
ColdSnap is qualified for (capabilities), and registering coldsnap-runtime with its container engines (runtimes)."""
