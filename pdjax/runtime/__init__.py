"""pdjax.runtime"""
