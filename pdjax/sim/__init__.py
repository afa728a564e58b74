"""pdjax.sim"""
