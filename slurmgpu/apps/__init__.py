"""Programs on top of the layers: gsbatch, the prediction daemon, doctor, demo."""
