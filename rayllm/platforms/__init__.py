"""Platform-specific code behind one hook per platform; generic code asks the platform, never the device type.
"""
