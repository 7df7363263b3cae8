"""ember.graphs"""
