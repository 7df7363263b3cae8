"""ember.attention_backends"""
