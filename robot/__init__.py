"""Deploy: Feetech bus driver, safety layer, control loop, the arm as a service, and the servo-bus
emulator they are tested against."""
