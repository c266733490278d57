"""Engine connectors. Each module imports its engine itself; importing this
package imports no engine."""
