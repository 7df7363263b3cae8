"""ember.models.layers"""
