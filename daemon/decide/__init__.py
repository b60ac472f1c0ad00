"""Decisions: the scheduler, the hard-constraint filter's users, the policies and their plugins."""
