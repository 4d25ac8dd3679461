"""A running inference server: started in its own namespaces and stopped with its whole tree (process), its state
file (state), the files it keeps on the host outside the CRIU images (hostfiles), where it answers (target) and
the validation probe that says it really serves (probe)."""
