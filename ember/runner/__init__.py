"""ember.runner"""
