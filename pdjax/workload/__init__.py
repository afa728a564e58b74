"""pdjax.workload"""
