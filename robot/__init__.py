"""Deploy: Feetech bus driver, servo-bus emulator, safety layer, control loop, encoder logs."""
