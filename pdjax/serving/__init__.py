"""pdjax.serving"""
