"""Submit-time path, standard library only: script -> request -> features -> decision -> rewrite."""
