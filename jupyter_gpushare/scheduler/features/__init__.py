"""Features that plug into the core and the shell.

MPS (mps, mps_control), deep idle (deep_idle's pure state machine, sleeping, checkpoint,
checkpoint_agent), allocations for Kubernetes (allocations, reservations, placement), the history
of status (history) and the NVML residency cross-check (nvml_check). Each uses the shell's
transport and the core's events; the shell's server is what switches them on.
"""
