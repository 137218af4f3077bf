"""What a run tells its user while it runs and when it ends: its status in storage (driver and Train
controller write it, `python -m training status` reads it) and webhook notifications."""
