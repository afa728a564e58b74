"""pdjax.models"""
