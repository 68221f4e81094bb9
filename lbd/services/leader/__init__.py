"""What only the elected leader runs: the election itself, shedding and the ownership monitor."""
