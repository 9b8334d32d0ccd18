"""The lab: calibration, cap control, sweeps, prompt sets and the device stamp (built on the engine)."""
