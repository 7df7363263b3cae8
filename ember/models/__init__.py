"""ember.models"""
