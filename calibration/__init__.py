"""Latency calibration: bastion-calibrate and the shipped profiles."""
