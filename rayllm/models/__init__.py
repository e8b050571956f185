"""Model families, one small file each over the shared layers, and the registry that maps a checkpoint's
architecture name to its class (a family = a file + one registry line).
"""
