"""pdjax.metrics"""
