"""Filter split (Krizhevsky et al. 2012, section 3.2): layers whose output channels are divided among actors, and the exchanges between them (``layers``)."""
