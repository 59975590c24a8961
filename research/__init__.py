"""Tools that explain results (the lab): where WIDE wins or loses against TEAL (where.py), and why weight
skipping fades in a batch (mask_union.py). Run from the repository root as `python -m research.NAME`;
the root modules never import from here."""
