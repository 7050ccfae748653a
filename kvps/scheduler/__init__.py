"""The scheduler role: registration, ranks, barriers, liveness and the end of the job."""
