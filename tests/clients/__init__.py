"""Real clients, installed as their users install them, run unchanged against a live beamline."""
